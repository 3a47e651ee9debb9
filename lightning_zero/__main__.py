from lightning_zero.cli import main

main()
