"""Testing aids that ship with sandboxq, importable without pytest (the pytest plugin,
``sandboxq.pytest_plugin``, is built on them):

    handlers       misbehaving handlers: hang, spin, hold the GIL, crash, exit, leak memory
    cases          each handler with the settings that provoke it and the outcome it must give
    workers        every worker a test starts (threads, burst runs, `sandboxq worker`
                   processes), from one factory that always stops them
    waiting        wait_for: poll a condition against a deadline that names what it waits for
    processes      which processes a test left behind
    redis_server   a throwaway redis-server on a free port or a Unix socket
    scratch        its temporary directory, swept by a later start once its owner is dead

The project's own test bench (the backend contract suite, the network proxy, throwaway
Cluster and Sentinel servers, the execution ledger) is in the repository's tests/support/,
not in the package.
"""
