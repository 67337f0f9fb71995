"""The disaggregation router: the OpenAI endpoint in front of prefill and decode instances."""
