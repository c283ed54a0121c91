"""The host layer: transports (local, SSH), the commands they run, operations and the host lock."""
