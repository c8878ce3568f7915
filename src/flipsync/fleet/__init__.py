"""The fleet: where a fleet's replicas are found (the `Pool` port: the board's member records, a static
list) and the gateway, one OpenAI-compatible front door that routes each request by policy version."""
