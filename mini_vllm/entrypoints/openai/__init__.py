"""The OpenAI-compatible server: ``api_server`` (routes, running it), ``protocol`` (request and response
bodies), ``serving_*`` (each endpoint's work), ``renderer``, ``metrics`` and ``cli_args`` (the flags)."""
