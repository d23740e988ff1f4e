from chandrad.cli import main

main()
