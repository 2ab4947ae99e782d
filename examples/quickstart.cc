// tpfuse's C++ quickstart: one fused all-reduce + residual add + RMSNorm over a team of 2 ranks,
// checked against float64. It runs on any machine: the ranks are threads of this process on the
// CPU backend (host pointers). On GPUs the call is the same, over tpfuse::create_cuda_team({0, 1})
// with device pointers and each rank's stream as allreduce_add_rmsnorm's last argument.
#include <tpfuse/tpfuse.h>
#include <tpfuse/version.h>

#include <cmath>
#include <cstdio>
#include <thread>
#include <vector>

int main() {
  constexpr int kWorld = 2, kTokens = 4, kHidden = 256;
  constexpr size_t kSize = size_t(kTokens) * kHidden;
  std::vector<std::vector<float>> input(kWorld, std::vector<float>(kSize));  // partial sums
  std::vector<float> residual(kSize), gamma(kHidden);
  for (size_t i = 0; i < kSize; ++i) {
    for (int r = 0; r < kWorld; ++r) input[r][i] = std::sin(0.01f * float(i) + float(r));
    residual[i] = std::cos(0.02f * float(i));
  }
  for (int h = 0; h < kHidden; ++h) gamma[h] = 1.0f + 0.001f * float(h);

  std::vector<tpfuse::Team> team = tpfuse::create_cpu_team(kWorld);
  std::vector<std::vector<float>> residual_out(kWorld, std::vector<float>(kSize));
  std::vector<std::vector<float>> norm_out(kWorld, std::vector<float>(kSize));
  tpfuse::Algorithm algorithm{};
  std::vector<std::thread> ranks;  // one thread per rank: a CPU call waits for its peers'
  for (int r = 0; r < kWorld; ++r) {
    ranks.emplace_back([&, r] {
      tpfuse::AddRmsNormArgs args;
      args.input = input[r].data();
      args.residual = residual.data();
      args.gamma = gamma.data();
      args.residual_out = residual_out[r].data();  // sum over ranks + residual
      args.norm_out = norm_out[r].data();          // rmsnorm(residual_out) * gamma
      args.tokens = kTokens;
      args.hidden = kHidden;
      args.dtype = tpfuse::DType::kFloat32;
      args.eps = 1e-6f;
      const tpfuse::Algorithm ran = tpfuse::allreduce_add_rmsnorm(team[r], args);
      if (r == 0) algorithm = ran;
    });
  }
  for (std::thread& rank : ranks) rank.join();

  double worst = 0;  // against float64, rank 0; every rank has the same bits
  bool same_bits = true;
  for (int t = 0; t < kTokens; ++t) {
    std::vector<double> sum(kHidden);
    double squares = 0;
    for (int h = 0; h < kHidden; ++h) {
      const size_t i = size_t(t) * kHidden + h;
      sum[h] = double(input[0][i]) + double(input[1][i]) + double(residual[i]);
      squares += sum[h] * sum[h];
    }
    const double rstd = 1.0 / std::sqrt(squares / kHidden + 1e-6);
    for (int h = 0; h < kHidden; ++h) {
      const size_t i = size_t(t) * kHidden + h;
      worst = std::fmax(worst, std::fabs(residual_out[0][i] - sum[h]));
      worst = std::fmax(worst, std::fabs(norm_out[0][i] - sum[h] * rstd * gamma[h]));
      same_bits = same_bits && norm_out[1][i] == norm_out[0][i];
    }
  }
  const bool ok = worst < 1e-4 && same_bits;
  std::printf("tpfuse %s, %s team of %d ranks (%s), %s: max |error| %.1e, ranks %s: %s\n",
              tpfuse::version(), team[0].backend() == tpfuse::Backend::kCpu ? "CPU" : "CUDA",
              kWorld, team[0].peer_memory().c_str(), tpfuse::algorithm_name(algorithm), worst,
              same_bits ? "identical" : "DIFFER", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
