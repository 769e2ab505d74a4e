"""The wire layer: spotguard's protocol, the bottom layer every part depends on.

One module per message type, each with its encoder, decoder and version check (`notice`,
`withdrawal`, `snapshot`, `membership`, `hook_report`, `agent_report`), the SSE framing
(`sse`), the one urgency order of notices (`urgency`), the live-notice set every stream
consumer keeps (`live`) and every shared name (`names`). Pure: no I/O, and it imports nothing
from the agent, hooks, supervisor, injector, trainer or emulator.
"""
