"""The loaderd client: what trainers import, and the wire contract shared with the daemon."""
