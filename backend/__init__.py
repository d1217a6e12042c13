"""The engine: model runner, paged KV pool (keys before RoPE), scheduler, segment cache and KV Collector."""
