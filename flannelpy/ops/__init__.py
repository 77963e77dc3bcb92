"""Operations: the prober, MTU consistency, doctor, disruption policy and rollout."""
