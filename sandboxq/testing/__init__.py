"""Testing aids that ship with sandboxq (importable without pytest): misbehaving handlers,
the backend contract suite, and a throwaway redis-server."""
