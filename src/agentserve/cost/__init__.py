"""Step-cost models (how long a step of given prefill and decode rows takes) and the
measured profiles they are fitted from; the simulator and the TTL model use them. No torch."""
