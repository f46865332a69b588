"""Offline jobs over the store: `lookup` (what is cached, no engine) and `warm` (prefill a
prompt set into the cache before traffic arrives).

- `prompts`: reading prompt sets (text lines, JSONL prompts or chats, a directory of
  documents, stdin) and turning them into token ids exactly as vLLM's completion and
  chat front ends do.
- `namespaces`: which registered namespace a model, dtype, block size and TP size
  mean — the one the next vLLM run with the connector will use.
- `lookup`: per prompt, the cached prefix the next run will load (the connector's rule).
- `warm`: plan (skip what is cached, too long or malformed), estimate, and run vLLM
  offline with the connector to write the rest. Only this module imports vLLM, lazily.
"""
