"""pytorchexample: the ClientApp of Flower's PyTorch quickstart; fedkl's diff is the two lines marked ``# fedkl``
(the node declares its user: the ledger never keys on Flower's node ids, which change every run)."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedkl.flower.dropin import declare_user  # fedkl
from pytorchexample.task import Net, load_data
from pytorchexample.task import test as test_fn
from pytorchexample.task import train as train_fn

app = ClientApp()
declare_user(app, lambda context: f"user-{context.node_config['partition-id']}")  # fedkl


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received model on this node's data; reply with the model and the training loss."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    partition, partitions = context.node_config["partition-id"], context.node_config["num-partitions"]
    trainloader, _ = load_data(partition, partitions, context.run_config["batch-size"])
    loss = train_fn(model, trainloader, context.run_config["local-epochs"], msg.content["config"]["lr"], device)
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(trainloader.dataset)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on this node's test records."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    partition, partitions = context.node_config["partition-id"], context.node_config["num-partitions"]
    _, testloader = load_data(partition, partitions, context.run_config["batch-size"])
    loss, accuracy = test_fn(model, testloader, device)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(testloader.dataset)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
