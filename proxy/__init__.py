"""The OpenAI-compatible server: sessions, rounds, shared segments, the round barrier, MQTT."""
