"""Dead letters: the messages the sidecar gives up on, and the operators' waiting room for them.

- ``publisher``: publishing a message to its subscription's dead-letter topic, with the reason.
- ``subscription``: Pub/Sub access of the ``dead-letters`` tooling (read without acking, ack, release).
- ``view``: what waits on a dead-letter subscription, as operators and scripts see it. Pure.
- ``replay``: sending dead letters back to their topic, then acking them.
- ``replay_marker``: the attributes a replay adds to a message. Pure.

May import ``sidecar.engine``, ``sidecar.config`` and ``sidecar.backoff``; not the pipeline that calls it.
"""
