"""Point a multi-agent framework at the TokenDance proxy by changing its base_url.

    tokendance.adapters.langgraph   ChatOpenAI, agent and round per call
    tokendance.adapters.camel       a CAMEL model backend per agent, set_round
    tokendance.adapters.autogen     an OpenAIChatCompletionClient per agent
    tokendance.adapters.rounds      Rounds: announce, seal, stats (any framework)
    tokendance.adapters.tags        headers / body tags and explicit shared blocks

Each framework module imports its framework; install the extra of the same name
(pip install 'tokendance[langgraph]', '[camel]', '[autogen]').
"""
