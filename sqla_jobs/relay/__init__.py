"""Hand chosen jobs to RabbitMQ or NATS JetStream, keeping the transactional enqueue.

The enqueuing code is unchanged: it adds a ``Job`` in its business transaction.
A relay claims the jobs of its queues, publishes each to the broker and
finishes the job only after the broker acknowledged it (at least once, the job
id as the message id for deduplication)::

    from sqla_jobs.relay import RabbitMQTarget, Relay, relayed

    relayed(queue, "order.created")   # the app accepts the kind; a worker that takes one by mistake snoozes it
    target = RabbitMQTarget("amqp://guest:guest@127.0.0.1:5672/",
                            routes={"order.created": "orders.created"}, bindings={"orders": "orders.#"})
    Relay(engine, queue, target, queues=["relay"]).run()

or ``sqla-jobs relay --app myapp.jobs:queue --queue relay --rabbitmq URL --route order.created=orders.created``.
See docs/howto/relay.md.
"""

from ._loop import MAX_UNCOUNTED_LOSSES, Relay, RelayCounts
from ._message import HEADER_ATTEMPT, HEADER_ID, HEADER_KIND, HEADER_QUEUE, Outgoing, Target
from ._nats import NatsTarget
from ._rabbitmq import RabbitMQTarget
from ._relayed import relayed

__all__ = [
    "HEADER_ATTEMPT",
    "HEADER_ID",
    "HEADER_KIND",
    "HEADER_QUEUE",
    "MAX_UNCOUNTED_LOSSES",
    "NatsTarget",
    "Outgoing",
    "RabbitMQTarget",
    "Relay",
    "RelayCounts",
    "Target",
    "relayed",
]
