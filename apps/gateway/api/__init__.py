"""The gateway's HTTP APIs: OpenAI chat, completions and Responses, Anthropic messages, tokens, models and
the front door; each route decodes and bounds its body here, then hands a bus request to the generation
pipeline."""
