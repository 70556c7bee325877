"""The server room, engine-neutral: request handling, the request schema and ingest, the service, caches, metrics."""
