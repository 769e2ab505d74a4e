"""Runs several sources at once and merges their updates into one async stream."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

from spotguard.agent.sources.base import Source
from spotguard.wire.withdrawal import Update


async def merged_updates(sources: Sequence[Source],
                         queue_size: int = 1024) -> AsyncGenerator[tuple[Source, Update], None]:
    """Yields (source, update) from every source as they come. Cancelling the consumer (or
    closing the generator) stops every source; a source's own loop never ends on its own."""
    queue: asyncio.Queue[tuple[Source, Update]] = asyncio.Queue(queue_size)

    async def pump(source: Source) -> None:
        async for update in source.run():
            await queue.put((source, update))

    tasks = [asyncio.create_task(pump(s), name=f"source:{s.name}") for s in sources]
    try:
        while True:
            yield await queue.get()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
