"""Comparisons with the peers: llama.cpp's server on this CPU (cpu_peer), the peers' own clients (peer_clients)."""
