"""KV connector: every DeepSeek-V4 cache component of a prefix, moved between engines and an entry store."""
