"""The LLM model runner: executes the scheduler's plans on the model (batch KV in slots,
rows, mixed attention, pre-packed CPU linears). The only place, with the loader, that
touches torch."""
