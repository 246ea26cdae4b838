"""The sandboxed child pool: children, their supervisor, and process-tree kills."""
