"""What every stage shares: named errors, atomic writes, regions of interest, configs to and from
dicts, the stamps that say what an output was made from, and a process's memory."""
