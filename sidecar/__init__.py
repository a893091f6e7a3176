"""pubsub-sidecar: Pub/Sub in, Firestore for durability, an ordered per-key gRPC stream out."""

__version__ = "0.1.0"
