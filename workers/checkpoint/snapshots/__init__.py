"""Every step's state in host memory, the rank's own and copies on buddy ranks, so a re-formed group continues from
the step a failure interrupted without reading storage (JobSpec checkpoint.in_memory).

A snapshot is a DCP checkpoint held in the process's SnapshotStore, at ``{SNAPSHOT_ROOT}/{job}/g{generation:04d}-step-
{step:08d}``, in a storage layout of its own (SnapshotWriter: each item's raw bytes, where DCP's file writers serialise
every tensor with torch.save, most of a small model's snapshot time). Each rank holds there its own two shard files,
DCP's ``.metadata`` (rank 0 writes it; a broadcast gives every rank a copy) and the copied shard files of the ranks it
is a buddy of: ranks one node (`shift` ranks) further round the ring. A rank's ``__{rank}_0.distcp`` holds what no
rank on another node holds (its FSDP, pipeline or tensor shards, its RNG) and goes to its buddies, so a node's loss
leaves a copy of it on the next node; its ``__{rank}_1.distcp`` holds its share of the items ranks on other nodes
hold too (replicas: ddp's state, the replicated parts of zero1, hybrid and tensor parallel) and stays home. Each such
item is kept on as many nodes as a copied shard is (its replicas + 1), by one rank each, the bytes spread evenly: on
many nodes, a rank copies a fraction of the replicated state, not all of it. The metadata names each item's copies,
and a restore reads whichever is at hand. The process keeps the two newest snapshots it has: a peer that finished one
step fewer can still be met at the step before.

Taking a snapshot overlaps the next step. The first one of a group is a full DCP save (its planning collectives, the
state staged into host buffers in the background); it leaves a layout (layout.py): which items this rank writes, where
each lies in its file, and views of the live tensors they come from. While the state keeps that structure, the next
snapshots reuse it: no state dict, no planning, each rank copies the live tensors into a shard file (in the memory
of a snapshot it has let go) and sends it to its buddies, over a gloo group of the snapshots' own. Whether the state
kept its structure on every rank is a vote the trainer carries in its own per-step all-reduce (no collective of its
own per step). The optimizer step waits for the snapshot before it; one is in flight at a time, so at any moment
every member holds the snapshot of the last step or the one before: a failure costs at most one step.

Where every rank holds the whole model and optimizer state and the optimizer step runs no collective (ddp), nothing
of that state is copied (LiveStateSnapshots): a rank's live state is its snapshot of the step it last completed, a
file made only when read (LiveFile). Before each optimizer step every rank's own items of the coming step's snapshot
(its RNG states, rank 0's metric points) go to every rank in one all-gather (`begin_snapshot`); a rank that
completes the step then holds the whole snapshot of its new state, and one that a failure stopped before it still
holds the one before, so the group continues from the newer step and redoes none.

After a failure the driver asks every member of the new group what it holds (`SnapshotStore.inventory`) and names
the newest snapshot they cover between them (resume_choice.py); `restore_from_peers` then moves to each
rank, over the new group, the shard files its part of the state needs (DCP's own load planner says which), and
DCP loads and reshards them to the new world size. Durable checkpoints are untouched; they serve only when memory
cannot cover a snapshot.

The modules, one concern each:

- store.py: a process's snapshots and their files (SnapshotStore), what it holds (`inventory`), which it keeps.
- shard_file.py: the format of a rank's shard file (RawSlot), and the memory of files let go, reused (FileBuffers).
- dcp_storage.py: DCP storage in the store (SnapshotWriter, SnapshotReader): which rank writes which item where.
- layout.py: what the snapshots of a group share while the state keeps its structure, and its fingerprints.
- step_snapshots.py: the trainer's one interface to a group's snapshots (StepSnapshots), NoSnapshots where none.
- group_snapshots.py: what both kinds of a group's snapshots share (the full save that makes the layout, the buddies).
- peer_snapshots.py: snapshots taken after every step and copied to buddies (PeerSnapshots): sharded state.
- live_state.py: snapshots that are the live state itself, where every rank holds all of it (LiveStateSnapshots).
- transport.py: how files travel between ranks (the buddies' ring exchange, an all-gather, one file sent).
- restore.py: a re-formed group's restore from its members' memory (`restore_from_peers`).
- resume_choice.py: which snapshot a re-formed group resumes from (plain data, no torch: the driver's choice).
"""
