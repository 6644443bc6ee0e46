"""Tool calling, engine side (pure): tool specs from Python callables, the model's own
tool-call format (Hermes / Qwen2.5 ``<tool_call>{json}</tool_call>``) parsed from a token
stream, calls validated against each tool's JSON Schema, and prompts rendered with tools."""
