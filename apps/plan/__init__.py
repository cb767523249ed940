"""The DAG planner: every stage's steps built from one resolved plan of the run (`resolved.RunPlan`),
each step a task of the stamps (`pipeline.core.stamps.Task`), its contract (apps/contracts.py)
and the Parsl app that runs it.

    resolved.py      the run's settings, paths, site and the facts derived from them, once
    step.py          a step, the plan of which steps run, their submission to Parsl
    training.py      stage, preprocess, train, select
    study.py         a study's cells
    segmentation.py  stitching, consensus, agglomeration
    evaluation.py    scores and the learned watershed
    export.py        the Neuroglancer layers
    dag.py           the whole run in dependency order
    describe.py      what the dry run and `status` print
"""
