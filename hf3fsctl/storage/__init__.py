"""Page files and the I/O engines that read and write them."""
