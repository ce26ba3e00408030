"""``python -m gpucomm.scaling``: predict a model's data-parallel scaling on clusters you do not have.

Profile the model on one device (or load a saved profile, or derive one from a built-in
architecture), then, for each cluster shape, predict the step time, samples/s and scaling
efficiency with the step model of ``gpucomm.tuning`` and NCCL's published cost model, and print the
best bucket plan for each. ``zoo`` holds plain-torch definitions of the reference image models.
"""
