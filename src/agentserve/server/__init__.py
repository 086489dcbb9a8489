"""The HTTP server: OpenAI chat completions and completions, the Responses API and
Anthropic's Messages API (each a thin translation onto the engine request chat builds),
request checks, program identity, the engine thread, metrics, the dashboard and the
OpenAPI document. It drives the engine and the runner through `llm.LLM`'s parts."""
