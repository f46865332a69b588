"""vLLM KV connector for hf3fsctl (installed as `hf3fsctl_connector`)."""
