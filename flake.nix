{
  description = "tpu-kernels: Pallas kernels for Google TPUs (torch-noarch, backends tpu and cpu)";

  nixConfig = {
    extra-substituters = [ "https://huggingface.cachix.org" ];
    extra-trusted-public-keys = [
      "huggingface.cachix.org-1:ynTPbLS0W8ofXd9fDjk1KvoFky9K2jhxe6r4nXAkc/o="
    ];
  };

  inputs = {
    # kernel-builder lives in the huggingface/kernels repository.
    kernel-builder.url = "github:huggingface/kernels";
  };

  outputs =
    {
      self,
      kernel-builder,
    }:
    kernel-builder.lib.genKernelFlakeOutputs {
      inherit self;
      path = ./.;
    };
}
