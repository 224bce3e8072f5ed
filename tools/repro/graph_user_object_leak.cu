// The CUDA driver's host leak that tools/lsan.supp suppresses, with no inferctx code: three
// graphs of one kernel each are captured, instantiated, launched, synchronized and destroyed,
// then the stream and buffer. Under AddressSanitizer's leak check, on driver 580.159.04 (H100):
//   variant 0 (plain graph, 1 or 5 launches each)     no leak
//   variant 1 (a user object retained by the graph)   600 bytes in 3 allocations, from cuGraphLaunch
//   variant 2 (plain graph, never launched)           no leak
// so the driver keeps 200 bytes per launched graph that holds a user object, which inferctx's
// captured dropout graphs do (their Philox call site is handed back through one).
// Build and run (ASan's shadow gap must stay unprotected for the driver's mappings):
//   nvcc -arch=sm_90 -g -Xcompiler=-fsanitize=address,-fno-omit-frame-pointer -c graph_user_object_leak.cu -o gl.o
//   g++ -fsanitize=address gl.o -L$CUDA_HOME/lib64 -lcudart_static -ldl -lpthread -lrt -o gl
//   ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1 ./gl VARIANT LAUNCHES
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
__global__ void k(float* p) { p[threadIdx.x] = 1.f; }
static void release(void* p) { free(p); }
int main(int argc, char** argv) {
  const int variant = argc > 1 ? atoi(argv[1]) : 0;  // 0 plain graph, 1 with a user object, 2 never launched
  const int launches = argc > 2 ? atoi(argv[2]) : 1;
  float* d; CK(cudaMalloc(&d, 1024));
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int g = 0; g < 3; ++g) {
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    k<<<1, 32, 0, s>>>(d);
    cudaGraph_t graph; CK(cudaStreamEndCapture(s, &graph));
    if (variant == 1) {
      cudaUserObject_t obj; CK(cudaUserObjectCreate(&obj, malloc(16), release, 1, cudaUserObjectNoDestructorSync));
      CK(cudaGraphRetainUserObject(graph, obj, 1, cudaGraphUserObjectMove));
    }
    cudaGraphExec_t exec; CK(cudaGraphInstantiate(&exec, graph, 0));
    if (variant != 2) for (int i = 0; i < launches; ++i) CK(cudaGraphLaunch(exec, s));
    CK(cudaStreamSynchronize(s));
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
  }
  CK(cudaStreamSynchronize(s));
  CK(cudaStreamDestroy(s)); CK(cudaFree(d));
  printf("variant %d, 3 graphs, %d launches each: done\n", variant, launches);
  return 0;
}
