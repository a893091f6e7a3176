"""Every ``pubsub-sidecar`` subcommand: the argument parser (``main``) and one module per command.

``run`` starts the sidecar (``sidecar.wiring.app``) and ends with its exit code (``exit_codes``:
the same codes for every command); ``status``, ``unblock`` and ``skip-gap`` talk to a running sidecar
over gRPC (``refusals``: how the last two report a refusal);
``dead-letters`` reads and replays the waiting room in Pub/Sub; ``outbox`` lists, retries and
discards what an outbox relay cannot publish (``sidecar.publishing.waiting_room``); ``demo`` runs
the emulators, the sidecar, a publisher and an app in one process.

The top of the import order: may import ``sidecar.wiring``, ``sidecar.delivery``,
``sidecar.dead_letters``, ``sidecar.config``, ``sidecar.ops``, ``sidecar.emulators``,
``sidecar.publishing`` and ``sidecar.engine``. Nothing imports it but ``sidecar.__main__``.
"""
