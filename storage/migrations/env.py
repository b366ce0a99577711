"""Alembic environment for chatkv's conversation database.

Driven programmatically by :func:`chatkv.storage.migrations.migrate`, which
passes its open connection (already in a transaction) as
``config.attributes["connection"]``. Without one (a developer running
``alembic`` by hand with ``config(url)``), it connects to ``sqlalchemy.url``.
"""

from alembic import context

from chatkv.storage.db import make_engine
from chatkv.storage.migrations import include_name
from chatkv.storage.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite cannot ALTER most things
        compare_type=True,
        include_name=include_name,  # the FTS5 index is not an ORM model
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
    else:
        engine = make_engine(config.get_main_option("sqlalchemy.url"))
        try:
            with engine.begin() as conn:
                _run(conn)
        finally:
            engine.dispose()
