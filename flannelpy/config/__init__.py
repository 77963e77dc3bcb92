"""Configuration: net-conf.json (netconf) and the agent's flags (settings)."""
