from analysis.recirculation.cli import main

main()
