"""The OpenAI-compatible server: ``api_server`` (routes, running it) and ``protocol`` (request and response bodies)."""
