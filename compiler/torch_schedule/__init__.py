"""torch.distributed.pipelining's schedule CSV, read into tpc plans and written from them.

    actions.py    the CSV: cells, actions, each with its file:line:col
    layout.py     the stage placement and counts a CSV implies; a header for a CSV alone
    slice_map.py  torch micro-batch index <-> (micro-batch, token slice), and the map file
    importer.py   actions -> instructions -> lowering -> verified plan, errors at the cells
    cells.py      the verifier's diagnostics said at the cells the instructions come from
    exporter.py   a plan's compute (and communication) order as a torch CSV, and its map
    compile.py    `tpc compile MODEL --schedule-file SCHED.csv`: a torch schedule on a real model
    load.py       a plan from a .tpir file or a torch CSV, verified (`tpc verify`, `tpc simulate`)

docs/torch-pipelining.md is the user's guide.
"""
