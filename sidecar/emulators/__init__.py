"""Pure-Python Pub/Sub, Firestore and Monitoring emulators, driven by Google's unmodified clients."""
