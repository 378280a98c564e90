"""The algorithms: the contract (contract.py), the registry (registry.py), the catalogue (catalog.py) and one
package per family (gradient/, output_perturbation/, localization/, kl/, frank_wolfe/)."""
