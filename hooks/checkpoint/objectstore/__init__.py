"""The S3-compatible tier of the checkpoint store (`checkpoint_dir="s3://bucket/prefix"`).

- url.py: the `s3://bucket/prefix` form and the object keys under it;
- client.py: the boto3 client (standard credential chain, endpoint override) and the check at start;
- remote.py: checkpoints as objects, complete or invisible without rename (manifest last);
- uploader.py: the background upload of each rank's part and rank 0's remote commit, retried through
  outages, within the local tier's bound (upload_policy.py: its pure decisions);
- staging.py: a rank's part staged by hard link and queued; durability.py: the job's tier (a commit
  known in the object store, never one rank's part);
- store.py: `ObjectCheckpointStore`, local disk first, the object store as the tier that survives the node.
boto3 is imported only when an object store is opened (extra `s3`).
"""
