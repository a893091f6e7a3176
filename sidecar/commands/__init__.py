"""Every ``pubsub-sidecar`` subcommand: the argument parser (``main``) and one module per command.

``run`` starts the sidecar (``sidecar.wiring.app``); ``status`` and ``unblock`` talk to a running
sidecar over gRPC; ``dead-letters`` reads and replays the waiting room in Pub/Sub; ``demo`` runs the
emulators, the sidecar, a publisher and an app in one process.

The top of the import order: may import any layer. Nothing imports it but ``sidecar.__main__``.
"""
