"""The agreed-step machine: everything that happens at a step the ranks agreed on, a drain and an
in-place membership change alike.

- `model`: phases, roles, outcomes and the one record of an agreed step (pure);
- `decide`: what an agreed notice asks of the group: drain, settle or resize (pure).
"""
