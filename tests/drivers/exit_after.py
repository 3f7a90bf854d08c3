"""A torchrun worker that ends with a given exit code after this node's delay, without training:
it lets a test set which node's ranks end first."""

import os
import sys
import time

time.sleep(float(os.environ["ALIGN_TEST_EXIT_DELAY_S"]))
sys.exit(int(sys.argv[1]))
