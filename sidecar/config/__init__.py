"""The sidecar's configuration: the config file, and the Google access the process runs with.

- ``model``: the config file's typed models and ``load_config`` (DESIGN §7): one-line errors.
- ``fields``: the field types every section shares (names, Pub/Sub names, durations, the strict model).
- ``relays``: the ``relays:`` section (DESIGN §12): outbox relays.
- ``errors``: reading the YAML and wording pydantic's errors in the file's own terms.
- ``durations``: durations and byte sizes as written in the file.
- ``credentials``: Google access checked before a command makes its first Google client.

May import ``sidecar.engine`` (its policy types), ``sidecar.shards`` and the standard library; nothing
else of the sidecar (every other layer reads its config from here).
"""
