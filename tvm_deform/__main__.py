from tvm_deform.tools.cli import main

raise SystemExit(main())
