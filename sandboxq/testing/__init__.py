"""Testing aids that ship with sandboxq, importable without pytest (the pytest plugin,
``sandboxq.pytest_plugin``, is built on them):

    handlers       misbehaving handlers: hang, spin, hold the GIL, crash, exit, leak memory
    cases          each handler with the settings that provoke it and the outcome it must give
    workers        SandboxWorkers on background threads, always stopped and joined
    processes      which processes a test left behind
    redis_server   a throwaway redis-server on a free port or a Unix socket
    contract       the suite every Backend must pass
"""
