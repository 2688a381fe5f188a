"""Mixture-of-experts concerns of the run beyond the model itself: which experts each token took and how
the trainer replays them (`routing`: routing replay's routes, their blocks and fetches), and where the
experts sit (`balance`: expert-load balancing, EDPB's planner for the trainer's EP ranks and the engines').
"""
