"""The inputs that learn what ran after the fact, from a log: the request log's format, written
by the gate and parsed here (requestlog.py), its tail (tail.py), llama-server's own log parsed
(enginelog.py) and its tail (enginetail.py). They call the sessions' tail protocol
(sessions/facade.py) and hold no ticket for what already ran. May import: sessions and below."""
