"""Sessions: conversations that keep their KV between turns, while idle, and across restarts.

``session`` (the SDK's Session handle), ``manager`` (SessionManager: saved conversations and the
one writer of their sessions' state), ``turn`` (one turn as an object: plan, admit, commit,
drive, settle), ``template`` (the chat template rendered for new messages only),
``context_window`` (what the KV window keeps, and how it moves), ``tools`` (tools a model can
call), ``snapshots`` (a conversation's KV on disk: write-behind, spill, restore, the disk budget)
and ``manifest_rows`` (the database rows that follow each snapshot's manifest). Import the module you
need: this package imports nothing itself.
"""
