"""What the tests share: server launchers and media (`helpers`), fakes, the zygote that forks test processes, stand-
ins for the peers (the Hub, receivers, a Mooncake consumer), the parts tiny checkpoints are made of, and the tiny
checkpoints themselves (`checkpoints/`, one module per family).

Tools may import these modules; nothing here imports a tool."""
