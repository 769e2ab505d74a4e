"""The agreed-step machine: everything that happens at a step the ranks agreed on, a drain and an
in-place membership change alike, walked as one table by one executor.

Following an agreed step, in the order a reader needs them:
- `executor`: `AgreedStepMachine.run(step, verdict)`: the walk, its timeouts, the one place
  errors are settled;
- `table`: the rows (phase, action, who, on error) and the actions;
- `decide`: drain, settle or resize (pure);
- `checkpoint`: the step's checkpoint (start, finish, abandon);
- `departure`: the one place a rank leaves (termination message, exit);
- `model`: phases, roles, outcomes and the one record (pure); `effects`: what the machine may ask
  of the Guard.
Below it: `hooks.group_session` (the groups, every timeout), `hooks.elastic.transfer` (the state
a change moves), `hooks.elastic.membership_view` (the group's hosts, pushed memberships).
"""
